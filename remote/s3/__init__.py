"""The node's S3 client (SigV4, errors, verification, manifests) and its download and upload engines.
"""
