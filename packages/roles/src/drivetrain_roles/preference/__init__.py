"""preference"""
