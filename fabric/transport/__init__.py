"""Moving bytes between nodes: the Fetch wire codec, the verified pull, swarm scheduling, discovery, rate limits."""
