"""The semantics: the single-process oracle (:mod:`.reference`), the summation order of combine
and unpermute (:mod:`.summation`), the argument checks every entry point shares
(:mod:`.validation`). Pure torch, no Triton import."""
