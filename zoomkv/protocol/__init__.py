"""The method protocol: what the memory engine asks of a KV method (``method.py``), the family bases that
write the shared parts once (``eviction.py``, ``recallable.py``), what a trainable method adds
(``training.py``, ``shape.py``), and the one registry of methods (``registry.py``). Nothing here knows a
method by name or imports the engine; the engine and every method import this."""
