"""The rank side: a warm process (`main`) that runs cell after cell (`scenario`) and reports facts.

It never imports the controller; it speaks to it through `core.messages` on its pipe.
"""
