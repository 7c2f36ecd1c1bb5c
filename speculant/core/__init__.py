"""Backend-neutral core: interfaces, value types, config, validator, engine loop, metrics."""
