"""format"""
