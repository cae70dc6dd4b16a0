"""The model frontend: tokenizer and chat-template resources that an artifact embeds."""
