"""The recipe: its schema and loading, the capability table of what combines with what, the model catalog, and where a model or reference is found."""
