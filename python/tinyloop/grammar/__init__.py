"""Grammar-constrained generation (docs/python.md, "Grammars" and "JSON schemas").

compiled: Grammar, GBNF text compiled against a model's vocabulary, and the built-in
JSON grammars; json_schema: JSON Schema to GBNF text (with json_schema_numbers,
json_schema_pattern and gbnf_text, pure Python, no library needed).
"""

from .compiled import JSON_GBNF, JSON_OBJECT_GBNF, Grammar, json_object_grammar, request_grammar
from .json_schema import SchemaError, json_schema_to_gbnf

__all__ = ["JSON_GBNF", "JSON_OBJECT_GBNF", "Grammar", "SchemaError", "json_object_grammar",
           "json_schema_to_gbnf", "request_grammar"]
