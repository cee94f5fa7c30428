"""Command-line tools: :mod:`.bench` (``moe-dispatch-bench``) and :mod:`.env`
(``python -m moe_dispatch.env``)."""
