"""Long-context tasks generated offline and seeded: each builds prompts from token pieces and scores
answers. One task per module."""
