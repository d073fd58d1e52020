"""Trained policies out of qarl: qarl's QWeights in compressed-tensors' layout (what vLLM
loads), and `export_run`, which writes a run's policy as a Hugging Face or compressed-tensors
folder (see README.md)."""

from qarl.export.compressed_tensors import ct_layer_tensors, ct_state, quantization_config, read_ct
from qarl.export.run import export_run

__all__ = ["ct_layer_tensors", "ct_state", "export_run", "quantization_config", "read_ct"]
