"""Package: the package's files (model, external data, genai_config.json, tokenizer, report) and
the output folder they are staged in."""
