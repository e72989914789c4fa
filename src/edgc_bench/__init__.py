"""`edgc bench`: every compressor side by side on emulated hosts joined by rate-limited links (docs/bench.md)."""
