"""tokenserve shared library: contracts (generated), runtime, SDK."""
