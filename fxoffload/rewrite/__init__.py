"""The rewrite: the only code that changes graphs (the transfer pairs of a plan; the tags that keep
reads of mutated inputs saved)."""
