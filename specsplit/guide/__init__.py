"""Guided decoding: a request's output held to a regular expression (a regex, a JSON schema, a
list of choices, any JSON object), compiled to a byte-level DFA (`regex_dfa`) and walked token by
token over the tokenizer's vocabulary (`tokens`); the verifier masks each row's logits to the
tokens that keep the output matchable."""
