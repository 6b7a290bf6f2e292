"""What the store tells: counters (:mod:`.stats`), Prometheus metrics (:mod:`.metrics`)
and captured access traces (:mod:`.trace`)."""
