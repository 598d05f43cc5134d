"""Analysis: reads graphs, tensors and generated code and returns data; changes nothing.

``graph`` (aliasing, storages, mutation), ``lifetimes`` (the saved tensors), ``memory`` (the FX
memory model), ``cost`` (compute and copy times), ``recompute`` (what could be rebuilt),
``outside`` (what code before a graph holds), ``output_code`` (the one reader of Inductor's wrapper
code) and ``code_memory`` (its replay).
"""
