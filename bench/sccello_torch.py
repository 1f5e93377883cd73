#!/usr/bin/env python3
"""PyTorch reference of the sccello encoder for the throughput row: bench/bert_cell_torch.py --arch sccello."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bert_cell_torch import main  # noqa: E402

if __name__ == "__main__":
    main("sccello")
