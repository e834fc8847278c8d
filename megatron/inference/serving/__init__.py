"""The generation server's HTTP side: Megatron-LM's ``PUT /api``, the OpenAI-compatible routes and the page's files.
It admits requests and answers them; the engine behind ``megatron.inference.service`` runs them."""
