"""Graph rewrites on the IR: constant folding, clean-ups, fusions, function expansion."""
