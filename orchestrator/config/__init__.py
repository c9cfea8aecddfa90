"""The inventory and job files: pydantic models, job rules, YAML positions.
"""
