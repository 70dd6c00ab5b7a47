"""Benchmarks: decoding modes side by side, the propose-time context sweep, and
round-vs-step timing at the shapes of real target/drafter pairs."""
