"""Weights that are never all in memory: trace a model whose parameters hold no data, then give
each ONNX initializer its values lazily, read or drawn when the package is written.

Gemma 4 E2B has 5.1 B parameters (20 GiB in fp32, 10 GiB in fp16); a 24 GiB machine cannot hold
them next to the traced program and their converted copies. So for a checkpoint folder (and for
``--random-weights``) the model is built with its parameters on the meta device
(``meta_model.build_on_meta``: nothing allocated; buffers real, from transformers' init), traced with fake tensors, and after
lowering every weight initializer becomes a placeholder (``placeholders.detach``; the lowered graph then serves
any weights of its architecture: ``exporter.cache.graph_cache``) and then an ``onnx_ir.LazyTensor``
(``placeholders.attach``) that reads its tensor from the safetensors files (only the slice a split piece needs),
draws it, or takes it from a model in memory (``stores.ModelWeights``: traced with its values, written the
same way), at the moment ``onnx_ir.save`` writes it. Each weight is materialised once, at the package's precision; later lazy steps
(transpose, int4 blocks) chain on it.

"Weights" are everything the model saves: its ``state_dict()``, parameters and persistent buffers
(Gemma 4's ``layer_scalar``). A checkpoint's persistent buffers are read like its parameters;
non-persistent buffers (rotary tables, embedding scales) are computed from the config and stay as
built. Every saved tensor must be in the checkpoint with its shape, and every checkpoint tensor must
be read, be a tied duplicate, or belong to a part of the model the export leaves out on purpose:
what is left over is reported (an error under ``strict``).

Initializer names are the program's state-dict targets: ``model.`` + the transformers tensor
name, and for a weight the split pass cut, ``<target>.use<U>.part<P>`` (pieces in order along
one axis).
"""
