"""Text generation with our models (the start of Megatron-LM's ``megatron.inference`` counterpart)."""
