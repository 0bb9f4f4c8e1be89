"""The variant model: specs and their names, per-family option records, the validity rules, the
resource budgets and the default configurations."""
