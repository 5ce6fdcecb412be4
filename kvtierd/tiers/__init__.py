"""Secondary tiers (docs/design/tiers.md): where blocks live besides the primary region."""
