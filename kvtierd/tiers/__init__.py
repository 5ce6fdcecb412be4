"""Secondary tiers (DESIGN.md §5-6): where blocks live besides the primary region."""
