"""MegaTrain: full-precision training of large Hugging Face causal LMs on one GPU.

Every parameter and AdamW state lives in host RAM; decoder layers stream through the GPU one at a
time. docs/architecture.md has the memory layout, the step schedule and the code map.
"""

__version__ = "0.1.0"
