"""The engine hub: attach, hooks, the per-step recorder and live metrics (:mod:`.live`)."""
