"""The harness around kda_opt, kept out of the runtime package: the benchmark and correctness CLI
(bench, behind scripts/test.py), its --test modes (host, decode, model, cp) and what they share with
it (common: the cases, timings and rows), the peers it times (peers: FLA's chunk_kda, FlashKDA) and the
random inputs that the tests, the benchmark and the profiles share (inputs)."""
