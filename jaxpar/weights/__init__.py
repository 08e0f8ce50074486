"""Saved weights, one layer below training, fine-tuning, inference and convert: opening a
saved run, restoring it onto any mesh, splitting and joining trained and frozen weights,
reading a base or a reference, quantizing. It imports none of the layers above; they all
import it."""

from jaxpar.weights.frozen import same_network, split_weights
from jaxpar.weights.quantize import quantize_params, quantized_kernels
from jaxpar.weights.saved import (SavedRun, load_base, open_run, read_network, relayout, resolve_run, run_name,
                                  saved_layer_order)
from jaxpar.trees import join, lookup, partition

__all__ = ["SavedRun", "join", "load_base", "lookup", "open_run", "partition", "quantize_params", "quantized_kernels",
           "read_network", "relayout", "resolve_run", "run_name", "same_network", "saved_layer_order",
           "split_weights"]
