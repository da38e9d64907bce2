"""objectives/llm"""
