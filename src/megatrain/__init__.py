"""MegaTrain: full-precision training of large Hugging Face causal LMs on one GPU.

Every parameter and AdamW state lives in host RAM; decoder layers stream through the GPU one at a
time. See docs/ and ../shared/DESIGN.md for the memory layout and the step schedule.
"""

__version__ = "0.1.0"
