"""The semantics: the single-process oracle (:mod:`.reference`), the argument checks every
entry point shares (:mod:`.validation`). Pure torch, no Triton import."""
