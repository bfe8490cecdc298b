"""unsplit internals; the public API is the flat ``unsplit`` namespace."""
