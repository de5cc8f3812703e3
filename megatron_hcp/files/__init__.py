"""The package's files: the one bounded reader of JSON / YAML (``bounded_read``), atomic writes
(``atomic_write``) and where the shipped recipes and fork-style diffs live (``data``)."""
