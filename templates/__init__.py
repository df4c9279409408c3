"""Jinja2 templates of the generated C (data files; see codegen.render)."""
