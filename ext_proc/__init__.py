"""tito's Envoy external processor: render, schedule, token-only rewrite, derender."""
