"""Teacher-forced model quality on token streams: perplexity, KL divergence against a reference, baselines."""
