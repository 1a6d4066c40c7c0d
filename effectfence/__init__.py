"""effectfence: exactly-once fence for side effects."""
