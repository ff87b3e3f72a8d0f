"""stop: a stop signal's rank side (children that outlive it, a step it broke); no rank imports."""
