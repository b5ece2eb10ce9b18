"""The only package that imports cuda.bindings / nvmath (ordering rule 1)."""
