#!/bin/sh
echo built
