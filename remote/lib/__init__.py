"""Small helpers every node module may use: files, secrets, retries, globs, destinations.
"""
