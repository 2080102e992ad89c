"""Shared by the slow local-network tests: a 3-layer variant of ``tiny`` (dim 64, vocab 512, rows of
32 tokens) that a 3 x 3 local network of real processes trains quickly on 2 cores."""

SMALL_CFG = {"model": {"name": "tiny", "dim": 64, "n_layers": 3, "n_heads": 4, "n_kv_heads": 2, "ffn_dim": 128,
                       "vocab_size": 512},
             "pipeline": {"stages": 3, "compression_ratio": 4},
             "data": {"vocab_size": 512, "seq_len": 32},
             "train": {"batch_size": 8, "micro_batch_size": 4, "lr": 1.0e-2, "warmup_steps": 2, "eval_batches": 2}}
