"""objectives"""
