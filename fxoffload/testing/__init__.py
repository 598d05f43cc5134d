"""Code for testing fxoffload and for its examples, kept where the backend never imports it.

- ``models``: the built-in example models (GPT, MLP, CNN, seq2seq) of the demo, the command line,
  the tests and the benchmarks;
- ``cuda_codegen``: Inductor's CUDA wrapper code for a training step, generated on a machine
  without a GPU.

Each ordering rule of the rewrite can be broken on purpose with the ``broken_rule`` option
(``fxoffload.options.BROKEN_RULES``), to prove that the suite notices.
"""
