"""Jinja2 templates of the generated C (data files; see convgrad.codegen.render)."""
