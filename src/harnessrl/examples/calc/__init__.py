"""examples/calc"""
