"""``fused-zero demo``: a small GPT trained with torch.optim and with fused_zero side by side on local
ranks (cli.py parses the command, run.py trains and compares, model.py holds the GPT and its data,
spawn.py starts the ranks; the test suite and the benchmarks start theirs through spawn.py too)."""
