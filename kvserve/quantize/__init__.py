"""``kvserve quantize``: calibrate a 16-bit checkpoint to weight-only INT8 / INT4
and write it in compressed-tensors ``pack-quantized`` format.

- ``options.py``: the command's settings (plain data) and the checks made
  before any work;
- ``data.py``: calibration text -> token windows;
- ``rtn.py``, ``gptq.py``, ``awq.py``: one linear (or one decoder layer for
  AWQ) at a time, producing ``quant/packing.py``'s ``QuantizedWeight``;
- ``pipeline.py``: the Hugging Face model run layer by layer over the
  calibration windows, each layer quantised before the next one's inputs
  are computed;
- ``writer.py``: the checkpoint, written into a temporary directory and
  renamed into place;
- ``cli.py``: the subcommand's flags and handler.

Nothing here is imported by the serving path.
"""
