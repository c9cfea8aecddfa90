"""Third-party code that ships with dfo's node-side modules (the node may not have it installed).

``packaging`` (Apache-2.0 OR BSD-2-Clause, licence files in packaging/) is vendored unmodified;
its version and wheel hash are pinned in vendor.txt and scripts/vendor_packaging.py refreshes it.
Node-side code imports it as ``remote._vendor.packaging``; the controller uses the installed one.
"""
