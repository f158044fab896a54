"""Offline pipeline that trains an EAGLE-3 head for the base model: prompts -> regenerated responses
-> (features) -> training with training-time test -> speculative-decoding evaluation."""
