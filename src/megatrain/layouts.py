"""The row layouts a run's micro-batches come in (defined once; no torch import).

The data section decides a run's layout (`DataConfig.layout`); the resource estimate plans for
it (masks, positions); `megatrain estimate --layout` asks what-if questions about it.
"""

LAYOUTS = ("padded", "packed", "full")
"""Right-padded rows with masks, packed samples (positions restart inside rows), or full rows
without a mask."""
